"""The wire layer the PS and the agent share: the protocol, its stubs, tensor encoding, the
block cache both sides mirror, and the protocol's limits below."""

# Descriptor.max_in_flight: the largest window of tiles a device may ask for (the PS refuses
# more at join, testbed.ps_backend.validation; the agent refuses a flag above it first)
MAX_IN_FLIGHT = 64
