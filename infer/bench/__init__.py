"""The benchmark library shared by ``scripts/benchmark.py`` (real targets, every method) and
``scripts/bench_scale.py`` (model shapes with random weights and an oracle drafter).

- ``timing``: interleaved wall-clock timing around the one host-device sync, forward counting;
- ``cost``: the verification cost t(N), the bound tau*t(1)/t(N) and efficiency;
- ``prompts``: benchmark prompts (files, MT-bench, the demo corpus's held-out split);
- ``methods``: the decoding methods compared on a real target, and timing them;
- ``profile``: where a speculative step's time goes;
- ``report``: summary rows, markdown tables and plots;
- ``oracle`` / ``shapes`` / ``scale``: the model-shape benchmark.
"""
