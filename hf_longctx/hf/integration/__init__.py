"""How ``hf_longctx`` plugs into a transformers and accelerate run: the ``longctx_*`` attention functions
(:mod:`.attention`), a batch of any collator as one packed sequence (:mod:`.rows`), its shards and the context that
travels with them (:mod:`.sharding`, :mod:`.context`, :mod:`.inputs`, the input hook), the models it can shard
(:mod:`.sharded_model`, :mod:`.model_support`, :mod:`.positions`, :mod:`.router_aux`), attention without a sharded
batch (:mod:`.unsharded`), the checks before a run is built (:mod:`.preflight`) and the Trainer callback
(:mod:`.callback`).

The top room of ``hf_longctx.hf``: it may import ``settings``, ``memory`` and ``parallel``, which never import it.
"""
