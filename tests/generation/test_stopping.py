import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glassformer.generation.stopping import IncrementalDecoder, TextStream


class Bytes:
    """One token per UTF-8 byte: multi-byte characters always span several tokens."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class SpaceEating:
    """Words as tokens; like SentencePiece, the decoded text never starts with a space."""

    words = ["hello", " world", " again", "!"]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.words[i] for i in ids).lstrip(" ")


def test_multibyte_characters_are_released_only_when_complete():
    tok = Bytes()
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in tok.encode("aé€😀b")]
    assert pieces == ["a", "", "é", "", "", "€", "", "", "", "😀", "b"]


def test_context_keeps_the_leading_space_of_the_first_new_token():
    decoder = IncrementalDecoder(SpaceEating(), context=[0])
    assert [decoder.push(1), decoder.push(2)] == [" world", " again"]


def test_flush_shows_an_unfinished_character_as_replacement():
    decoder = IncrementalDecoder(Bytes())
    assert decoder.push(0xE2) == ""
    assert decoder.flush() == "\ufffd"


@settings(max_examples=100, deadline=None)
@given(text=st.text(min_size=0, max_size=30))
def test_pieces_concatenate_to_the_decoded_text(text):
    tok = Bytes()
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in tok.encode(text)] + [stream.flush()]
    assert "".join(pieces) == text == stream.text


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abcé ", max_size=25),
    stop=st.lists(st.text(alphabet="abcé ", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_strings_cut_at_their_first_occurrence(text, stop):
    tok = Bytes()
    ids = tok.encode(text)
    stream = TextStream(tok, stop)
    pieces = []
    for token in ids:
        pieces.append(stream.push(token))
        if stream.stop_string is not None:
            break
    else:
        pieces.append(stream.flush())
    # oracle: the first prefix of tokens whose text contains a stop string, cut at the earliest
    prefixes = [tok.decode(ids[:n]) for n in range(len(ids) + 1)]
    done = [p for p in prefixes if any(s in p for s in stop)]
    if done:
        index, first = min((i, s) for s in stop if (i := done[0].find(s)) >= 0)
        assert (stream.text, stream.stop_string) == (done[0][:index], first)
    else:
        assert stream.text == text and stream.stop_string is None
    assert "".join(pieces) == stream.text  # nothing past the stop string was ever shown


def test_text_that_may_start_a_stop_string_is_held_back():
    tok = Bytes()
    stream = TextStream(tok, ["END"])
    assert [stream.push(i) for i in tok.encode("xEN")] == ["x", "", ""]
    assert stream.push(ord("d")) == "ENd"  # "ENd" is not "END": released
    assert [stream.push(i) for i in tok.encode("yEND")] == ["y", "", "", ""]
    assert stream.stop_string == "END" and stream.text == "xENdy"


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="stop"):
        TextStream(Bytes(), [""])


def test_flush_releases_unfinished_characters_and_held_back_text_together():
    tok = Bytes()
    stream = TextStream(tok, ["ab\ufffdz"])
    assert [stream.push(i) for i in [ord("a"), ord("b"), 0xE2]] == ["", "", ""]
    assert stream.flush() == "ab\ufffd" and stream.text == "ab\ufffd"
    plain = TextStream(tok)
    assert [plain.push(ord("a")), plain.push(0xE2), plain.flush()] == ["a", "", "\ufffd"]
