"""Our GGUF-built tokenizer against Hugging Face's tokenizer for the same file."""

import pytest

EDGE_CASES = [
    "The capital of France is",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand\r\nwindows line ends",
    "multiple    spaces between    words",
    "naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어",
    "emoji 🙂👍🏽 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math",
    "numbers 1234567890 3.14159 -42 1e-5 2024-11-21",
    "code: def f(x):\n    return x**2  # comment",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "special tokens glued<|im_end|>to text<|endoftext|>",
    "<|im_start|><|im_start|>double",
    "a partial <|im_start tag and |> stray brackets",
    "<repo_name>kvcourse<file_sep>README.md",
    "don't won't it's we'll they're I'm you've",
    "URL https://example.com/a?b=c&d=e#frag",
    "zero\u200bwidth and non\u00a0breaking space",
]


@pytest.mark.parametrize("text", EDGE_CASES)
def test_ids_equal_hugging_face(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", EDGE_CASES)
def test_decode_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode("2024")
    assert len(ids) == 4 and tok.token_strings(ids) == ["2", "0", "2", "4"]


def test_chat_template_matches_the_gguf_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    own = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert own.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert tok.encode_chat("Hi") == tok.encode(text)


def test_chat_template_matches_hugging_face_jinja(tok, hf_tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == theirs


def test_bad_input(tok):
    with pytest.raises(TypeError, match="text"):
        tok.encode(["not", "a", "string"])
    with pytest.raises(ValueError, match="ids"):
        tok.decode([1, 10**6])
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        tok.apply_chat_template([{"content": "no role"}])
