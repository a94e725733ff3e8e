"""Studies around the service, not the service: the scale simulator (``simulate``: the paper's
chaos simulation at thousands of chips) and the synchronous data-parallel baseline (``baseline``)
that the benchmarks compare against. Installed as ``islands.studies``."""
