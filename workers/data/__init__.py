"""The data layer: text sources (the embedded stdlib corpus, files, the Hub), token shards
prepared once and read by position, their manifest, and the order each island reads them in."""
