"""A file's size as code tokens: Python's tokenize, with comments, docstrings and layout (newlines, indentation) left
out, so that packing statements onto fewer lines saves nothing and a why-comment costs nothing; and its prose as
words of its comments and docstrings (an Args field's docstring is its --help text)."""

import ast
import io
import tokenize

LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def docstrings(source):  # where each string that is a statement of its own starts
    return {
        (node.lineno, node.col_offset)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def code_tokens(source):
    strings = docstrings(source)
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return sum(
        1
        for token in tokens
        if token.type not in LAYOUT and not (token.type == tokenize.STRING and token.start in strings)
    )


def prose_words(source):
    strings = docstrings(source)
    words = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            words += len(token.string.lstrip("#").split())
        elif token.type == tokenize.STRING and token.start in strings:
            words += len(ast.literal_eval(token.string).split())
    return words
