"""The gRPC link between a region in its own Ray cluster and the home cluster's syncer.

``wire`` converts the data path's values to and from the protobuf messages of ``link.proto``
and chunks them (pure, no network); ``security`` holds the token interceptor and TLS credentials;
``relay`` is the region's socket-level byte counter and WAN emulation; ``server`` is the home
side (``LinkServer``) and ``client`` the region side (``LinkClient``, the region's stand-in for
the syncer). The region agent that runs a region over it (``islands region join``) is the
controller in region mode, beside the controller: ``islands.orchestrator.region_agent``.
"""
