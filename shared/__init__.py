"""What every layerline process may import: the pieces no single service owns.

Wire helpers and gRPC options (`rpc`, `wire`), sampling parameters (`sampling`), the model
configuration (`model_config`), the error vocabulary (`errors`), settings shared by processes
(`settings`), the OpenTelemetry setup (`telemetry`), certificates and TLS credentials (`certs`,
`tls`), the caller's role (`access`), route tags (`routes`), and serving a generated servicer
with the health service beside it (`services`). Imports no service (client, coordinator, stage
worker) and never torch.
"""
