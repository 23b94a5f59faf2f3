"""What tracerl keeps beside a store, as immutable objects committed like the store's own records (data first,
then a commit object created with put-if-absent): policy versions (`tracerl.artifacts.weights`), trainer
checkpoints (`tracerl.artifacts.checkpoints`), the rollout's recorded codes (`tracerl.artifacts.codes`), and the
safetensors codec and commit-object helpers they share (`tensorfile`, `objects`). The formats are specified in
``schemas/ARTIFACTS.md``.
"""

from tracerl.artifacts import checkpoints, codes, errors, objects, tensorfile, weights

__all__ = ["checkpoints", "codes", "errors", "objects", "tensorfile", "weights"]
