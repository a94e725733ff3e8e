"""Studies around the service, not the service: the scale simulator (``simulate``: the paper's
chaos simulation at thousands of chips), the synchronous data-parallel baseline (``baseline``)
that the benchmarks compare against, and the lockstep harness (``lockstep``) that measures
regional pre-merge against the flat link with the timing taken out. Installed as
``islands.studies``."""
