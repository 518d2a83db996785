"""Research and benchmarks' machinery: it imports the product, and nothing in the product imports it.

- :mod:`.cad`: CAD's kernel profiles (:mod:`.cad.profiled`: the (q_len, kv_len) grid; :mod:`.cad.call_profile`: the
  launch cost model fitted to timed calls), recalibration on measured server times (:mod:`.cad.calibrate`) and the
  forward placement fit (:mod:`.cad.placement`).
- :mod:`.emulation`: W ranks emulated on one device, each rank's kernels timed.
- :mod:`.torch_cp_peer`: torch native context parallelism, the peer the benchmarks measure against.
- :mod:`.cli`: ``hf-longctx-lab profile-cad --out FILE`` makes the cost model file CAD's ``cost_model`` option names.

Training never imports this package (``tests/test_lab_apart.py`` checks): a cost model is fitted ahead of a run and
read from its file by :mod:`hf_longctx.backends.cad.model_file`.
"""
