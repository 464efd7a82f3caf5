"""The NIXL transport: pull (one-sided READs) and push (WRITEs), its agent, push's change inboxes."""
