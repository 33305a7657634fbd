def slugify(text):
    return "-".join(text.split(" "))
