"""``keyq demo``: order events through real workers and a janitor, checked against a plain fold
of what was published. Imports nothing, so that Spark's Python workers importing the order
pipeline (``keyq.demo.orders``) import nothing heavy."""
