import pytest
from checkpoints import write_word_tokenizer

from evenflow.proto.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_word_tokenizer(path)
    return Tokenizer(path)


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_streamed_deltas_join_to_the_full_decode(tok):
    out = ids(tok, "w5 w6 w7 w8 w9")
    detok = IncrementalDetokenizer(tok, ids(tok, "w3 w4"))
    text = "".join(detok.add([t]) for t in out) + detok.flush()
    assert text == detok.text
    assert text.strip() == tok.decode(out)


def test_stop_string_cuts_the_text_and_never_leaks_a_partial_stop(tok):
    detok = IncrementalDetokenizer(tok, [3], stop=["w7 w8"])
    streamed = ""
    for t in ids(tok, "w5 w6 w7 w8 w9"):
        streamed += detok.add([t])
        assert "w7" not in streamed  # held back until decided
    assert detok.stopped
    assert streamed.strip() == "w5 w6"


def test_stop_string_can_be_kept(tok):
    detok = IncrementalDetokenizer(tok, [3], stop=["w6"], include_stop=True)
    detok.add(ids(tok, "w5 w6 w7"))
    assert detok.stopped and detok.text.strip() == "w5 w6"


def test_chat_template_and_missing_files(tok, tmp_path):
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "user hi "
    with pytest.raises(TokenizerError, match="tokenizer.json is missing"):
        Tokenizer(tmp_path)
