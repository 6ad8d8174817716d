"""CPU specifics: XLA's flags, aligned host arrays, the oneDNN and strided convolutions."""
