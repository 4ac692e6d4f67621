"""Incremental detokenization and stop-string search: O(new text) per step, same answers as
decoding everything."""

from __future__ import annotations

from shardserve.text import IncrementalText, find_stop


def byte_decode(ids: list[int], skip: bool) -> str:
    """A byte-level 'tokenizer': each id is one UTF-8 byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_text_grows_to_the_full_decode_and_holds_partial_characters():
    data = "naïve café — 東京 ok".encode()
    inc, grown = IncrementalText(), []
    for b in data:
        grown.append(inc.add([b], byte_decode, True))
        assert not inc.text.endswith("\ufffd")
        assert byte_decode(list(data), True).startswith(inc.text)
    assert inc.text == data.decode()
    assert sum(grown) == len(inc.text)
    assert 0 in grown  # the first byte of a multi-byte character added nothing yet


def test_decode_windows_stay_short():
    """Each step decodes only the tokens since the last boundary, not the whole output."""
    seen = []

    def counting(ids, skip):
        seen.append(len(ids))
        return byte_decode(ids, skip)

    inc = IncrementalText()
    for b in ("x" * 2000).encode():
        inc.add([b], counting, True)
    assert max(seen) <= 2 and inc.text == "x" * 2000


def test_find_stop_sees_a_match_that_began_before_the_new_text():
    assert find_stop("hello wor", 3, ["world"]) is None
    assert find_stop("hello world", 2, ["world", "lo w"]) == (6, "world")
    assert find_stop("ab STOP cd STOP", 4, ["STOP"]) == (11, "STOP")  # the first was seen earlier
    assert find_stop("xyz", 1, ["q", "z"]) == (2, "z")


def test_invalid_bytes_are_held_for_a_few_tokens_only():
    """A lone continuation byte never completes: after MAX_HOLD more tokens it is taken as U+FFFD,
    so the text (and stop strings on it) keeps up and the decode window stays short."""
    inc = IncrementalText()
    for b in [0x80] * 12 + list(b"done"):
        inc.add([b], byte_decode, True)
    assert inc.text.endswith("done") and "\ufffd" in inc.text
    assert len(inc.ids) - inc.prefix_offset <= 6
