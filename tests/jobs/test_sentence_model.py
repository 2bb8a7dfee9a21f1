"""The search model, all-MiniLM-L6-v2 in numpy: the vectors sentence-transformers' recipe makes with transformers."""

from __future__ import annotations

import numpy as np
import pytest

from npumoe.jobs.search.sentence_model import MAX_TOKENS, model_dir, sentence_model

TEXTS = ["How long could the firm survive with zero income?",
         "Cash reserves stand at 1.9 million euros, enough to cover eight months of fixed costs.",
         "Rinse the lentils under cold water until the water runs clear. " * 40]  # past the model's 256 tokens


def test_the_numpy_model_gives_what_transformers_gives_mean_pooled_and_normalised() -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir()), AutoModel.from_pretrained(model_dir()).eval()
    batch = tokenizer(TEXTS, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
    with torch.inference_mode():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((states * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    assert np.abs(sentence_model().embed(TEXTS) - expected).max() < 1e-4


def test_a_paraphrase_is_nearer_than_another_subject_and_a_text_embeds_alone_as_in_a_batch() -> None:
    model = sentence_model()
    before = model.calls
    question, answer, other = model.embed(TEXTS)
    assert question @ answer > question @ other
    assert np.allclose(model.embed(TEXTS[:1])[0], question, atol=1e-5)  # padding in a batch changes nothing
    assert model.calls == before + 4
