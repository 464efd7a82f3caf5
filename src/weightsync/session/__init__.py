"""One rank's session: the job settings (config.py), the settings that do not combine
(combinations.py), planning and the transport (sync_session.py)."""
