"""dynabatch inside other libraries: each module imports its library only when it runs.

* :mod:`dynabatch.integrations.sentence_transformers`: sentence-transformers' ``encode`` on dynamic batches;
* :mod:`dynabatch.integrations.trl`: datasets packed by dynabatch in TRL's packed format;
* :mod:`dynabatch.integrations.ray`: Ray Data's ``map_batches`` on dynamic batches.

Nothing in the core imports this package.
"""
