"""What keeps a comparison fair: ratios paired round by round, the baseline as a person runs it, exactness
checked layer by layer."""
