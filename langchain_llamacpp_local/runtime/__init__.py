"""The engine core: token-level requests and typed reply items (``requests.py``), the
reply channel, the worker thread that owns a context and its handle (``worker.py``), the
step loop it runs (``loop.py``) over its request records (``active.py``), admission
(``admission.py``), the step scheduler (``scheduler.py``, pure) and the call-cost model
it reads (``step_cost.py``), the output pipeline (``output.py``), speculation and its
verify (``speculative.py``, ``verify.py``), label scoring, per-token log-probabilities,
LoRA per request, the worker's stats snapshot (``stats.py``) and the model registry.
Nothing here knows chat messages, templates or output formats (``chat/`` does), and
nothing here resolves a model name: the public classes resolve it (``resolution/``)
and hand the registry a load config.
"""
