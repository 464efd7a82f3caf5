"""The ports: what the roles need from engines and training frameworks (engine.py), the one port
for device effects (device.py), and what the job channel needs of the coordinator (coordinator.py)
with the records it speaks (records.py)."""
