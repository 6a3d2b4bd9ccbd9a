"""The API reference's examples, unchanged except ``import pytensor as theano``."""

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(90)


def test_introductory_example(forked):
    import numpy as np
    import pytensor as theano
    import pytensor.tensor as T
    import synkhronos as synk

    synk.fork()
    x = T.matrix('x')
    y = T.vector('y')
    z = T.mean(x.dot(y), axis=0)
    f_th = theano.function(inputs=[x, y], outputs=z)

    f = synk.function(inputs=[x], bcast_inputs=[y], outputs=z)
    synk.distribute()

    x_dat = np.random.randn(100, 10).astype('float32')
    y_dat = np.random.randn(10).astype('float32')
    x_synk = synk.data(x_dat)
    y_synk = synk.data(y_dat)
    r_th = f_th(x_dat, y_dat)
    r = f(x_synk, y_synk)

    assert np.allclose(r, r_th)


def test_shared_variable_example_up_to_the_function_call(forked):
    import pytensor as theano
    import pytensor.tensor as T
    import synkhronos as synk

    synk.fork(2)
    s_init = np.ones(2, dtype='float32')
    x = T.matrix('x')
    s = theano.shared(s_init, name='s')
    f = synk.function([x], updates=[(s, T.sum(x * s, axis=0))])
    synk.distribute()
    x_dat = synk.data(np.array([[1, 1],
                                [2, 2],
                                [3, 3],
                                [4, 4]]).astype('float32'))
    print("\ns initial:\n", s.get_value())
    np.testing.assert_array_equal(s.get_value(), s_init)

    f.as_theano(x_dat.data)
    print("\ns after Theano call:\n", s.get_value())
    rows = np.array([[1, 1], [2, 2], [3, 3], [4, 4]], dtype="float32")
    np.testing.assert_array_equal(s.get_value(), (rows * s_init).sum(axis=0))   # [10, 10]

    s.set_value(s_init)
    f(x_dat)
    print("\nlocal s after reset and Synkhronos call:\n", s.get_value())
    # the master (rank 0) updated s from its own half of the rows only
    np.testing.assert_array_equal(s.get_value(), (rows[:2] * s_init).sum(axis=0))  # [3, 3]
