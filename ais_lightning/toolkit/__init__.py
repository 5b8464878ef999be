"""What only the scripts in ``tools/`` (and the tests) use: sweep reports from MLflow stores (``report``), a local
MLflow server (``mlflow_server``), the run builder's helpers for tools (``probes``) and shared measures
(``measure``). Neither the library nor the application imports it."""
