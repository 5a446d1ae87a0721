"""Which rank failures are the echo of another rank's end, not a cause of their own.

When one rank leaves its process group (it raised and its process tore the group down, it
died, or it simply returned), every peer still inside a collective with it raises gloo's
"Connection closed by peer" / "Connection reset by peer" a moment later. Which report the
parent reads first is a race (the forkserver relays one rank's end, a pipe the other's), so
the order of arrival must not decide the headline: ``verdict`` names a rank whose failure is
no echo over every echo, and when every failure is an echo of ranks that *returned*, says so
instead of gloo's "typically caused by a remote worker crashing".
"""

from __future__ import annotations

from tutorial_impl.testing import words
from tutorial_impl.testing.rank import outcome as _o

# What a rank's collective raises when a peer's end of the connection is gone (gloo's words;
# "reset" when data sent to it was still unread, "closed" when not: a matter of timing).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
# The advice gloo appends to those, which is wrong when the peer merely returned.
GLOO_ADVICE = "This is typically caused by a remote worker"


def is_echo(result: _o.Outcome) -> bool:
    """Whether ``result`` is a rank's collective failing because a peer's connection went
    away: an exception whose message names a lost peer connection."""
    return isinstance(result, _o.Raised) and any(w in result.message for w in PEER_GONE)


def causes(outcomes: dict[int, _o.Outcome], order: list[int]) -> list[int]:
    """The failed ranks, the likeliest cause first: ranks that died (their peers' errors
    follow from the death), then ranks that raised an error of their own, then the echoes;
    within each, in the order their reports arrived."""
    failures = [r for r in order if isinstance(outcomes[r], _o.Failure)]
    deaths = [r for r in failures if isinstance(outcomes[r], _o.Died)]
    own = [r for r in failures if r not in deaths and not is_echo(outcomes[r])]
    echoes = [r for r in failures if r not in deaths and r not in own]
    return deaths + own + echoes


def consequence(outcomes: dict[int, _o.Outcome], order: list[int], cause: int, rank: int) -> bool:
    """Whether ``rank``'s failure followed from ``cause``'s: an echo of a rank that died or
    raised an error of its own, or any exception that arrived after the news of a death."""
    first, failure = outcomes[cause], outcomes[rank]
    if not isinstance(failure, _o.Raised) or is_echo(first):
        return False
    if is_echo(failure):
        return True
    return isinstance(first, _o.Died) and order.index(rank) > order.index(cause)


def returned_peers(outcomes: dict[int, _o.Outcome], cause: int) -> list[int]:
    """When the cause (``causes``'s first) is an echo, so no rank died or raised an error of
    its own: the ranks that had returned, whose connections closed as they left (the peer
    gloo calls "crashing"); else []."""
    if not is_echo(outcomes[cause]):
        return []
    return sorted(r for r, o in outcomes.items() if isinstance(o, _o.Returned))


def returned_headline(headline: str, result: _o.Outcome, returned: list[int]) -> str:
    """``headline`` (of the echo ``result``) without gloo's advice that a remote worker
    crashed, saying instead which peers had returned."""
    summary = result.summary if isinstance(result, _o.Raised) else ""
    advice = summary[summary.find(GLOO_ADVICE) :] if GLOO_ADVICE in summary else ""
    said = words.peers_returned(returned)
    if advice:
        return headline.replace(advice, said, 1)
    return f"{headline} {said}"
