import unittest

import slugify as m


class TestSlugify(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.slugify("Hello World"), "hello-world")

    def test_1(self):
        self.assertEqual(m.slugify("a b"), "a-b")

    def test_2(self):
        self.assertEqual(m.slugify("A  B"), "a-b")

    def test_3(self):
        self.assertEqual(m.slugify("Rust, Go!"), "rust-go")
