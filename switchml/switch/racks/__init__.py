"""Two levels of aggregation: rack switches under a spine."""
