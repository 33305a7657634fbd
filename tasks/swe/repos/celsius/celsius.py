def c_to_f(c):
    return c * 5 / 9 + 32


def f_to_c(f):
    return (f - 32) * 9 / 5
