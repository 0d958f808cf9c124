"""What the benchmarks, the soak and the overload burst measure, one module per thing measured;
the entry points in scripts/ only parse their command line and call these.

``bench.py``'s five scenarios (``suite`` runs them; ``plan`` sizes them; ``report`` and ``plots``
write their sections): ``saturation``, ``sse_ceiling`` (against ``sse_ceiling_app``),
``scheduling``, ``concurrency``, ``cancel_storm``. The rest: ``soak`` (``soak.py``),
``overload`` (``overload_burst.py``), ``replicas`` (``bench_replicas.py``), ``model_serving``,
``transformers_reference`` and ``model_comparison`` (``bench_model.py``), ``model_step``
(``bench_model_step.py``), ``int4_kernels`` (``bench_int4.py``), ``batch_runner``
(``bench_batch.py``), ``routing`` (``bench_routing.py``).
"""
