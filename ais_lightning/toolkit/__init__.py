"""The helpers of the scripts in the repository's ``tools/`` (which are the programs: benchmarks, probes, the sweep
report, the claims check): sweep reports from MLflow stores (``report``), a local MLflow server (``mlflow_server``),
the run builder's helpers for tools (``probes``), shared measures (``measure``) and the rollout profiler
(``profiling``). Not part of the library: neither the library nor the application imports it."""
