"""Runtime tests: the fake engine lives next to them."""
