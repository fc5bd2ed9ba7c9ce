"""Plain values to and from the wire messages that several services share.

Owns reading and writing `SamplingParams` (an absent field takes the neutral value the proto
documents) and turning a failure into the `Status` message a step answers with (its code from
`errors.status_of`). Imports the generated messages and nothing of any service.
"""

from __future__ import annotations

from layerline.protos.v1 import common_pb2

from .errors import Code, status_of
from .sampling import SamplingParams


def sampling_from_wire(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Read the wire message; absent fields take the proto's documented defaults."""
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def sampling_to_wire(params: SamplingParams, msg: common_pb2.SamplingParams) -> None:
    """Fill `msg` (max_tokens and stop are the coordinator's, and are not sent on)."""
    msg.temperature = params.temperature
    msg.top_p = params.top_p
    msg.top_k = params.top_k
    msg.min_p = params.min_p
    msg.repetition_penalty = params.repetition_penalty
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs


def status_message(err: BaseException) -> common_pb2.Status:
    """The Status a failure answers with: its code by kind (`errors.STATUS_OF`), its message."""
    return common_pb2.Status(code=status_of(err), message=str(err))


def status_code(msg: common_pb2.Status) -> Code:
    """The code of a received Status (OK when it is unset)."""
    return Code.of(msg.code)
