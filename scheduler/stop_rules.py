"""The stop rules: what ends a request as its sampled tokens are appended (eos and stop
token ids, max_tokens, max_model_len, a grammar the output completed). The scheduler's
`update_from_output` is their one caller: the one place a request finishes on its own."""

from __future__ import annotations

from scheduler.request import Request, RequestStatus


def append_tokens(request: Request, tokens: list[int], max_model_len: int) -> RequestStatus | None:
    """Append tokens one by one until one finishes the request: its status, or None."""
    output_ids = request.output_token_ids
    all_ids = request.all_token_ids
    params = request.sampling_params
    for token in tokens:
        output_ids.append(token)
        all_ids.append(token)
        status = None
        # Cheap screen first: most tokens trip none of the stop rules.
        if (
            len(output_ids) >= params.max_tokens
            or len(all_ids) >= max_model_len
            or token in request.stop_screen
        ):
            status = check_stop(request, token, max_model_len)
        if status is None and request.grammar is not None and _grammar_done(request, token):
            status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            return status
    return None


def check_stop(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The finished status the new token puts the request in, or None.

    A stop token wins over length when both apply: the model did end there.
    """
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens and (
        (token in request.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
    ):
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if num_output >= params.max_tokens or len(request.all_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def _grammar_done(request: Request, token: int) -> bool:
    """Advance the request's grammar; True when its output is complete (or the token broke
    the grammar, which the mask rules out unless every allowed token was masked by
    something else, such as min_tokens holding back eos): either way it must stop. The
    text held back so far is kept, unlike a stop string's (stop_reason stays None)."""
    grammar = request.grammar
    return not grammar.accept_token(token) or grammar.is_terminated()
