"""The job channel: the only speaker of the job protocol to the meta server (channel.py), what
crosses it (wire.py), and a rank's lease (heartbeat.py)."""
