"""CS231n's VGGNet case study (https://cs231n.github.io/convolutional-networks/#case) and seed 001.

The table below is the course's, row by row: the layer, its output volume ("memory", in values) and its weights
(biases not counted by the course).  The engine derives each row from torchvision's VGG-16 graph under the
``cs231n`` convention.  The course's total "24M * 4 bytes ~= 93MB / image" does not follow from its own rows,
which add up to 15,237,608 values (about 61 MB, 58 MiB): a long-standing erratum.
"""

from __future__ import annotations

import pytest
import sympy

from symmem import derive
from symmem.apps.from_counts import from_counts
from symmem.cli import main

# (CS231n row, torchvision node, memory (values per image), weights without biases)
VGG16_TABLE = [
    ("INPUT [224x224x3]", "image.volume", 224 * 224 * 3, 0),
    ("CONV3-64 [224x224x64]", "features.0", 224 * 224 * 64, (3 * 3 * 3) * 64),
    ("CONV3-64 [224x224x64]", "features.2", 224 * 224 * 64, (3 * 3 * 64) * 64),
    ("POOL2 [112x112x64]", "features.4", 112 * 112 * 64, 0),
    ("CONV3-128 [112x112x128]", "features.5", 112 * 112 * 128, (3 * 3 * 64) * 128),
    ("CONV3-128 [112x112x128]", "features.7", 112 * 112 * 128, (3 * 3 * 128) * 128),
    ("POOL2 [56x56x128]", "features.9", 56 * 56 * 128, 0),
    ("CONV3-256 [56x56x256]", "features.10", 56 * 56 * 256, (3 * 3 * 128) * 256),
    ("CONV3-256 [56x56x256]", "features.12", 56 * 56 * 256, (3 * 3 * 256) * 256),
    ("CONV3-256 [56x56x256]", "features.14", 56 * 56 * 256, (3 * 3 * 256) * 256),
    ("POOL2 [28x28x256]", "features.16", 28 * 28 * 256, 0),
    ("CONV3-512 [28x28x512]", "features.17", 28 * 28 * 512, (3 * 3 * 256) * 512),
    ("CONV3-512 [28x28x512]", "features.19", 28 * 28 * 512, (3 * 3 * 512) * 512),
    ("CONV3-512 [28x28x512]", "features.21", 28 * 28 * 512, (3 * 3 * 512) * 512),
    ("POOL2 [14x14x512]", "features.23", 14 * 14 * 512, 0),
    ("CONV3-512 [14x14x512]", "features.24", 14 * 14 * 512, (3 * 3 * 512) * 512),
    ("CONV3-512 [14x14x512]", "features.26", 14 * 14 * 512, (3 * 3 * 512) * 512),
    ("CONV3-512 [14x14x512]", "features.28", 14 * 14 * 512, (3 * 3 * 512) * 512),
    ("POOL2 [7x7x512]", "features.30", 7 * 7 * 512, 0),
    ("FC [1x1x4096]", "classifier.0", 4096, 7 * 7 * 512 * 4096),
    ("FC [1x1x4096]", "classifier.3", 4096, 4096 * 4096),
    ("FC [1x1x1000]", "classifier.6", 1000, 4096 * 1000),
]


@pytest.fixture(scope="module")
def vgg():
    return derive("vgg16", convention="cs231n", optimizer="sgd-momentum", values={"B": 1})


def test_rows_in_order(vgg):
    names = [x.name for x in vgg.terms if x.category == "activation"]
    assert names == [row[1] for row in VGG16_TABLE]


@pytest.mark.parametrize("row, node, memory, weights", VGG16_TABLE, ids=[f"{i}:{r[0]}" for i, r in
                                                                        enumerate(VGG16_TABLE)])
def test_layer(vgg, row, node, memory, weights):
    from symmem.models import build

    term = next(x for x in vgg.terms if x.name == node)
    assert vgg.evaluate(term.elements) == memory
    assert vgg.evaluate(term.expr) == 4 * memory
    graph = build("vgg16").graph
    params = graph.node(node).params if node in graph else {}
    w = params.get("weight", ())
    assert (vgg.evaluate(sympy.Mul(*w)) if w else 0) == weights


def test_totals(vgg):
    values = sum(row[2] for row in VGG16_TABLE)
    assert vgg.value("activations") == 4 * 15_237_608 == 4 * values
    assert vgg.value("parameters") == 138_357_544
    # the course's weights leave out the biases: the graph's weight tensors, without biases, are its rows' sum
    from symmem.graph import parameter_shapes
    from symmem.models import build

    weights = sum(vgg.evaluate(sympy.Mul(*s)) for _, p, _, s in parameter_shapes(build("vgg16").graph)
                  if p == "weight")
    assert weights == sum(row[3] for row in VGG16_TABLE) == 138_344_128
    # the course's "24M" total is not the sum of its own rows (15.2M): the erratum
    assert abs(vgg.value("activations") / 4 - 24_000_000) > 8_000_000


def test_backward_and_parameters_x3(vgg):
    assert vgg.transient == vgg.activations  # "~*2 for bwd" as its own term
    assert [x.name for x in vgg.terms if x.category == "transient"] == ["backward"]
    assert vgg.value("parameter_memory") == 3 * 4 * 138_357_544
    assert vgg.value("total") == 2 * 4 * 15_237_608 + 12 * 138_357_544


def test_batch_scales_activations():
    d = derive("vgg16", convention="cs231n", values={"B": 64})
    assert d.value("activations") == 64 * 4 * 15_237_608


# -- a Q&A about CS231n estimates (seed 001) --------------------------------------------------------------
@pytest.fixture(scope="module")
def seed001():
    return from_counts(activations=532_752, parameters=19_072_984, input_shape=(180, 50, 1), batch=128)


def test_seed001_asker(seed001):
    assert seed001.reproduces_qa and seed001.asker is seed001.one_image  # the former name still answers
    parts = dict(seed001.one_image.parts)
    assert round(parts["activations of one image x4 B"] / 2**20, 2) == 2.03
    assert round(parts["parameters x3 (weights, gradients, cache) x4 B"] / 2**20, 2) == 218.27
    assert round(parts["input batch (128 images) x4 B"] / 2**20, 2) == 4.39
    assert seed001.one_image.printed == 224.69


def test_seed001_answer(seed001):
    assert seed001.per_batch.printed == 742.34
    assert round(seed001.per_batch.total / 2**20, 2) == 742.93  # without rounding 4.0646 to 4.06 first


def test_seed001_correct(seed001):
    n, a, x, b = 19_072_984, 532_752, 180 * 50 * 1, 128
    assert seed001.correct.total == 16 * n + 2 * 4 * b * (a + x)
    assert seed001.lower_bound == 16 * n + 4 * b * (a + x)
    # the asker's "another 260.13 MB" is the batch's activations, which the engine keeps
    kept = dict(seed001.correct.parts)[f"kept activations, {b} images x4 B"]
    assert round(kept / 2**20, 2) == 260.13
    assert len(seed001.differences) >= 5


def test_seed001_cli(capsys):
    assert main(["counts", "--activations", "532752", "--parameters", "19072984", "--input", "180x50x1",
                 "--batch", "128"]) == 0
    out = capsys.readouterr().out
    assert "224.69" in out and "742.34" in out and "820.09 MiB" in out
    assert "a Q&A about CS231n estimates" in out and "the question's figure" in out and "the answer's" in out
    assert "asker" not in out and "seed" not in out


def test_counts_on_your_own_numbers_speak_of_your_network(capsys):
    assert main(["counts", "--activations", "1000000", "--parameters", "5000000", "--batch", "32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("your network: 1,000,000 activation values per image, 5,000,000 parameters")
    for word in ("Q&A", "question", "answer", "asker", "printed", "seed"):
        assert word not in out, word
    r = from_counts(activations=1_000_000, parameters=5_000_000, input_shape=(224, 224, 3), batch=32)
    assert not r.reproduces_qa and r.one_image.name.startswith("CS231n recipe")


def test_counts_cli_errors(capsys):
    assert main(["counts", "--activations", "0", "--parameters", "5"]) == 2
    assert main(["counts", "--activations", "5", "--parameters", "5", "--input", "3x3"]) == 2
