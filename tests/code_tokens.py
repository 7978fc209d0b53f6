"""A file's size as code tokens: Python's tokenize, with comments, docstrings and layout (newlines, indentation) left
out, so that packing statements onto fewer lines saves nothing and a why-comment costs nothing."""

import ast
import io
import tokenize

LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_tokens(source):
    tree = ast.parse(source)
    docstrings = {
        (node.lineno, node.col_offset)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return sum(
        1
        for token in tokens
        if token.type not in LAYOUT and not (token.type == tokenize.STRING and token.start in docstrings)
    )
