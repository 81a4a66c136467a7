"""The lens's layers over the API: `glassformer.lens.layers` returns those residuals of the
all-layer lens, and a layer the model lacks is answered 400 in OpenAI's error shape."""

from test_steering import MODEL, _complete, _refused


def test_lens_layers_return_those_layers_of_the_all_layer_lens(client, language_model):
    every = _complete(client, "a dog ran", lens={"top_k": 2})["glassformer"]["lens"]
    some = _complete(client, "a dog ran", lens={"top_k": 2, "layers": [2, 0]})["glassformer"]["lens"]
    assert some["ids"] == every["ids"]
    assert some["layers"] == [every["layers"][2], every["layers"][0]]
    assert [layer["site"] for layer in some["layers"]] == ["blocks.1.resid_post", "embed.out"]


def test_unknown_or_repeated_lens_layers_get_400(client, language_model):
    last = language_model.config.n_layers

    def ask(layers):
        return client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                     "glassformer": {"lens": {"layers": layers}}})

    for layers in ([last + 1], [1, 1]):
        _refused(ask(layers), 400, "glassformer.lens.layers")
    for layers in ([], [-1], ["1"]):
        _refused(ask(layers), 400, "glassformer.lens.layers")
    assert ask([last]).status_code == 200
