def transpose(rows):
    if not rows:
        return []
    return [[row[i] for row in rows] for i in range(len(rows[0]))]
