"""Side by side with the peers on one GPU (``scripts/bench_peers.py``): each system trains the same workload.

- :mod:`.workload`: the model shape, the packed row, the one FLOPs formula;
- :mod:`.longctx`, :mod:`.alst`, :mod:`.torch_cp`, :mod:`.plain`: the systems (hf_longctx, ALST, TRL context
  parallelism, plain transformers), each a class built from (workload, device) with ``settings`` and
  ``train(steps, clock)``; each module's docstring names the public source of its settings;
- :mod:`.worker`: one system's measurement in a process of its own; :mod:`.measure`: its clock and peaks;
- :mod:`.runner`: the parent's side (subprocesses, host-memory sampling, the longest-context search, the table).

The peers' packages (DeepSpeed, Liger-Kernel, TRL; torchao for hf_longctx's host optimizer) are the ``peers``
extra; each is imported only in the process of the system that uses it.
"""
