"""Integrations: weightsync inside other systems, built on the roles (writer, reader).

Each module (or package) is imported only by the system it plugs into, by name from that
system's configuration, or by the user's own code; nothing in weightsync below them imports
one (``tests/test_architecture.py``):

* ``vllm_backend`` / ``vllm_trainer``: the ``"weightsync"`` backend of vLLM's weight-transfer
  API, worker side and trainer side (vLLM imports them by the module paths that
  :func:`weightsync.engines.vllm.register` names);
* ``vllm_selfcheck`` / ``sglang_selfcheck``: ``weightsync doctor --engines``'s end-to-end
  update of a live engine (the proof they share is ``selfcheck``); ``vllm_memory``: the reader
  process of ``weightsync bench --suite vllm-memory``;
* ``ray``: Ray actors as ranks, the meta server as a named actor (docs/distributed.md);
* ``verl``: verl's checkpoint-engine backend (imports verl);
* ``trl`` / ``trl_sync``: TRL's GRPOTrainer through weightsync (imports trl; docs/distributed.md).
"""
