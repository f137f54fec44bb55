"""When a request is done: EOS, stop token ids, max_tokens, max_model_len.

Stop strings are not checked here: the frontend detokenizes, finds them, and aborts the request.
"""

from echo.core.request import Request, RequestStatus


def check_stop(request: Request) -> RequestStatus | None:
    """The finished status the last appended token gives the request, or None to go on.
    Sets request.stop_reason for a stop token id. A stop token that arrives on the length
    limit counts as a stop: the model did end there."""
    # plain attributes and len()s, no properties: this runs per request per step
    output = request.output_token_ids
    last_token_id = output[-1]
    params = request.sampling_params
    if len(output) >= params.min_tokens:
        if last_token_id in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and last_token_id in params.stop_token_ids:
            request.stop_reason = last_token_id
            return RequestStatus.FINISHED_STOPPED
    if len(request.prompt_token_ids) + len(output) >= request.token_limit:
        return RequestStatus.FINISHED_LENGTH
    return None
