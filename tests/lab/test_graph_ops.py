"""scripts/bench/graph_ops.py: counting the primitives of a lazy graph and attributing them to parts."""

from functools import partial

import mlx.core as mx

from scripts.bench.graph_ops import REST, count_step


def test_ops_go_to_the_first_part_that_needs_them():
    a = mx.array([1.0, 2.0])
    mx.eval(a)
    first = mx.exp(a)  # Exp
    second = (first * 2).reshape(2, 1)  # Broadcast of the scalar, Multiply, Reshape
    root = second.sum() + 1  # Sum (and its Squeeze), Add
    count = count_step([root], [("first", first), ("second", second)])
    assert count.by_part == {"first": 1, "second": 3, REST: 3}
    assert count.total == sum(count.by_primitive.values()) == 7
    assert count.by_primitive["Exp"] == 1 and count.views == 3  # Broadcast, Reshape, Squeeze


def test_each_call_of_a_compiled_function_is_its_own_op():
    """export_to_dot names a node by its primitive, which calls of one compiled function share."""
    f = partial(mx.compile, shapeless=True)(lambda x: mx.sigmoid(x) * x)
    a = mx.array([1.0, 2.0])
    mx.eval(a)
    count = count_step([f(f(a))], [])
    assert count.total == 2 and count.by_part == {REST: 2}


def test_relabelled_outputs_name_their_primitive():
    a = mx.array([1.0])
    mx.eval(a)
    out = mx.sin(a)
    count = count_step([out + 1], [("part", out)], relabel=[("my_kernel", out)])
    assert count.by_primitive["my_kernel"] == 1 and "Sin" not in count.by_primitive
    assert count.by_part["part"] == 1
