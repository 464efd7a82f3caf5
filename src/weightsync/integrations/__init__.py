"""Backends that plug weightsync into RL frameworks' own weight-sync registries (verl: ``verl.py``).

Each module imports its framework at the top, and is imported only by that framework (by
name, from its configuration), never by weightsync itself.
"""
