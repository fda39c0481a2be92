"""The torch-free request types: what a request is inside an engine and what a step moves.

`sequence.py` (`Sequence`, `SampleGroup`, `make_sequence`), `batch.py` (the scheduler/runner
contracts: `StepPlan`, `ScheduledSequence`, `SampledToken`, `RunnerOutput`, `TokenLogprobs`),
`progress.py` (how a sequence is admitted and advanced), `beam_search.py` (a beam search's
bookkeeping) and `convert.py` (their `pagedserve.v1` forms). Schedulers import these; no module
here imports torch (an import-linter contract and tests/test_import_rules.py check it), so every
policy runs on CPU without it. Tensors stay in the runner, the sampler and the kernels.
"""
