"""One batch, as stages: read, admit (one disposition per delivery), effects in one order, the
outcome; with retries and poison isolation around them."""
