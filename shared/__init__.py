"""What every layerline process may import: the pieces no single service owns.

Wire helpers and gRPC options (`rpc`, `wire`), sampling parameters (`sampling`), the model
configuration (`model_config`), the error vocabulary (`errors`), settings shared by processes
(`settings`) and the OpenTelemetry setup (`telemetry`). Imports no service (client, coordinator,
stage worker) and never torch.
"""
