"""weightsync inside RL frameworks: verl (``verl.py``, a backend in its registry) and TRL (``trl.py``).

Each module imports its framework at the top, and is imported only from outside (verl: by
name, from its configuration; TRL: by the training script), never by weightsync itself.
"""
