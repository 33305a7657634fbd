import unittest

import slugify as m


class TestSlugify(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.slugify("Hello World"), "hello-world")
