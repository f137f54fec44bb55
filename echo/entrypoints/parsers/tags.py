"""What streaming parsers share: a chunk may end inside a tag."""


def held_tag_start(text: str, tag: str, start: int) -> int:
    """Where the end of text[start:] may begin tag (len(text) if it cannot): that tail has to
    wait for the next chunk before anyone can tell what it is."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)
