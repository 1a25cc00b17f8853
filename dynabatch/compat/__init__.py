"""The documented APIs of other batching systems, each a thin layer over dynabatch's core.

One module or sub-package per system, with that system's names, argument
order and defaults:

* :mod:`dynabatch.compat.axolotl`: axolotl's multipack sampler and packing functions;
* :mod:`dynabatch.compat.bionemo`: NVIDIA bionemo's size-aware and bucket batching;
* :mod:`dynabatch.compat.multitask`: the memory-aware multi-task training system.

DynamiCat's planners need no module of their own: they are the core's
constraints on :class:`dynabatch.SmartBatchSampler`. Nothing in the core
imports this package.
"""
