"""Each job's printed tables drawn from its rows alone, one module a job (``tables.<job>``, its
``tables(rows, section=None) -> list[str]``): the job prints them, and ``python -m benchmarks
render`` redraws a page's ``<!-- rows:<job>[:<section>]:begin -->`` block from the committed
``benchmarks/results/data/<job>.rows.jsonl``. Pure Python: never imports jax."""
