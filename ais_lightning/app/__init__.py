"""``ais-train``, the application: config composition and validation (``config``, ``build``, ``rules``), the
Lightning Trainer and its callbacks (``trainer``, ``signals``), tracking (``tracking``), resume (``resume``),
failures (``failures``), the SFT warm start (``warmstart``), the end-of-run summary (``summary``) and the Hydra
configs (``conf/``). The library packages import nothing from here."""
