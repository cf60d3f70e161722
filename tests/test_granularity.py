import pytest

import qbits
from qbits import InvalidArgumentError, PerChannel, PerTensor, Tiled
from qbits._granularity import BlockLayout


def test_block_sizes():
    assert PerTensor().block_sizes((3, 4, 5)) == (3, 4, 5)
    assert PerChannel((0, -1)).block_sizes((3, 4, 5)) == (3, 1, 5)
    assert PerChannel(()).block_sizes((3, 4)) == (1, 1)
    assert Tiled(axis=1, tile_size=2).block_sizes((3, 4, 5)) == (1, 2, 1)
    assert Tiled(axis=-1, tile_size=5, shared_axes=(0,)).block_sizes((3, 4, 5)) == (
        3,
        1,
        5,
    )
    assert PerChannel(1).shared_axes == (1,)
    # Left to the matmul: the contracting axes.
    assert PerChannel().block_sizes((3, 4, 5), contracting_axes=(0, 2)) == (3, 1, 5)
    assert Tiled(tile_size=2).block_sizes((3, 4), contracting_axes=(1,)) == (1, 2)
    assert Tiled(axis=2, tile_size=3).block_sizes(
        (3, 4, 6), contracting_axes=(1, 2)
    ) == (
        1,
        4,
        3,
    )


def test_tiled_takes_the_last_contracting_axis_and_shares_the_others():
    # A weight gradient contracting [batch, seq]: tiles along seq.
    assert Tiled(tile_size=2).block_sizes((3, 4, 6), contracting_axes=(0, 1)) == (
        3,
        2,
        1,
    )
    assert Tiled(tile_size=2).block_sizes((3, 4, 6), contracting_axes=(2, 1)) == (
        1,
        2,
        6,
    )
    with pytest.raises(InvalidArgumentError, match="no contracting axis"):
        Tiled(tile_size=2).block_sizes((3, 4), contracting_axes=())


def test_block_layout():
    layout = BlockLayout.create((6, 8, 5), (6, 4, 1))
    assert layout.blocked_shape == (6, 2, 4, 5)
    assert layout.reduce_axes == (0, 2)
    assert layout.scale_shape == (1, 2, 5)
    # Size-1 axes, per-tensor.
    assert BlockLayout.create((1, 7), (1, 7)) == BlockLayout((1, 7), (0, 1), (1, 1))


def test_block_layout_of_zero_size_axes():
    # Used to divide by zero. A shared empty axis has one scale entry.
    assert BlockLayout.create((0, 8), (0, 8)) == BlockLayout((0, 8), (0, 1), (1, 1))
    assert BlockLayout.create((0, 8), (1, 8)).scale_shape == (0, 1)
    assert BlockLayout.create((8, 0), (8, 1)).scale_shape == (1, 0)
    assert BlockLayout.create((0, 8), (4, 4)) == BlockLayout(
        (0, 4, 2, 4), (1, 3), (0, 2)
    )
    assert PerTensor().block_sizes((0, 8)) == (0, 8)
    assert Tiled(axis=0, tile_size=32).block_sizes((0, 8)) == (32, 1)


@pytest.mark.parametrize("blocks", [(0, 8), (3, 8), (4,), (4, 9), (4.0, 8), (-4, 8)])
def test_block_sizes_that_do_not_fit_are_an_error(blocks):
    class Bad(qbits.Granularity):
        def block_sizes(self, shape, contracting_axes=None):
            return blocks

    with pytest.raises(InvalidArgumentError, match=r"Granularity: block_sizes="):
        qbits.Quantizer(qbits.IntNumerics(), granularity=Bad()).quant(
            qbits.numerics._base.jnp.ones((4, 8))
        )


@pytest.mark.parametrize(
    "granularity, shape, pattern",
    [
        (
            Tiled(axis=1, tile_size=3),
            (4, 128),
            r"tile_size=3 .*axis 1 has size 128.*1, 2, 4",
        ),
        (
            Tiled(axis=2, tile_size=2),
            (4, 8),
            r"Tiled: axis=2 .*-2\.\.1 for an array of rank 2",
        ),
        (PerChannel((0, 2)), (4, 8), r"PerChannel: shared_axes=2 .*-2\.\.1"),
        (PerChannel((0, -2)), (4, 8), r"shared_axes=\(0, -2\) .*distinct"),
        (
            Tiled(axis=0, tile_size=2, shared_axes=(0,)),
            (4, 8),
            r"other than the tiled axis",
        ),
        (PerChannel(), (4, 8), r"PerChannel: shared_axes=None .*outside a matmul"),
        (Tiled(tile_size=2), (4, 8), r"Tiled: axis=None .*outside a matmul"),
    ],
)
def test_granularity_that_does_not_fit_the_shape(granularity, shape, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        granularity.block_sizes(shape)
    with pytest.raises(InvalidArgumentError, match=pattern):
        qbits.Quantizer(qbits.IntNumerics(), granularity=granularity).quant(
            qbits.numerics._base.jnp.ones(shape)
        )


@pytest.mark.parametrize(
    "build, pattern",
    [
        (lambda: Tiled(tile_size=0), r"Tiled: tile_size=0 .*>= 1"),
        (lambda: Tiled(axis=1.0), r"Tiled: axis=1\.0"),
        (lambda: PerChannel("0"), r"PerChannel: shared_axes='0'"),
        (lambda: Tiled(shared_axes=(True,)), r"shared_axes=\(True,\)"),
    ],
)
def test_bad_arguments(build, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        build()
