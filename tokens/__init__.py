"""Tokenizers and the ties between two of them (DESIGN §13): the bytes each token stands for
(`pieces`), the alignment of two tokenisations of one text (`alignment`) and the projection of one
vocabulary onto another (`projection`). Above `base/` only: precompute aligns rows with it, train
projects teacher distributions with it."""
