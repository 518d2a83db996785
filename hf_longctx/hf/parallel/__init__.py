"""How a model's weights are split over ranks beside sequence parallelism: FSDP2 (:mod:`.fsdp`), attention heads over
a tensor-parallel group (:mod:`.heads`), and a recipe's tensor and expert parallel sizes applied to a model in one
call (:mod:`.model_parallelism`).

Of ``hf_longctx.hf`` it imports ``settings`` only.
"""
